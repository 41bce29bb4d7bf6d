"""AutoDDL plans executed with DTensor, plus the `hetrain plan` command.

Importing this package does not import torch.distributed; `execute`, `runs` and `launch` do.
"""
