"""hetrain: train PyTorch models across heterogeneous devices faster than DDP.

profile -> plan -> train -> report. See README.md for the architecture.
"""

__version__ = "0.1.0"
