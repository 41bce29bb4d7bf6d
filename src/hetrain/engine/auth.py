"""Who may join a run: a per-run secret that every rank proves to rank 0, and rank 0 to it.

torch.distributed lets any process that reaches the rendezvous store take a rank; nothing in
gloo checks who it is. Right after the process group forms, rank 0 and each other rank run a
challenge-response over it (HMAC-SHA256 of a fresh random nonce, both ways), so a process
that does not hold the run's secret is refused before any message of the run is read, and a
rank never trusts a rank 0 that does not hold it either.

Where the secret comes from, first match wins:
  1. `hetrain run`/`launch` on one machine generate one and hand it to the processes they
     spawn (never written anywhere);
  2. HETRAIN_SECRET (the secret itself) or HETRAIN_SECRET_FILE (a file holding it; it must
     not be readable by other users), set on every node: the way for several machines;
  3. otherwise, on one machine under torchrun, rank 0 writes a fresh one to
     runs/<name>/.secret (mode 0600) before the rendezvous and the other ranks read it after
     it; rank 0 deletes it once every rank has proved it.

A worker that joins the running job (`hetrain join`, hetrain.engine.join) proves the same
secret over its private link (`join_challenge` / `join_respond`, roles of their own) before
rank 0 reads anything from it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hetrain.errors import ConfigError

if TYPE_CHECKING:
    from hetrain.engine.wire import Link

ENV_SECRET = "HETRAIN_SECRET"
ENV_SECRET_FILE = "HETRAIN_SECRET_FILE"
SECRET_FILE = ".secret"
JOIN_SECRET_FILE = ".join-secret"
"""A spawned run's generated secret, mode 0600, kept while the run lasts so that a worker
started on this machine by the same user can join it (`hetrain join`); removed at the end."""
NONCE_BYTES = 32

HOW_TO_SET = (f"export {ENV_SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))')"
              " with the same value on every node")


def new_secret() -> str:
    return secrets.token_hex(32)


def configured_secret() -> str:
    """The secret from HETRAIN_SECRET or HETRAIN_SECRET_FILE, or "" when neither is set."""
    if os.environ.get(ENV_SECRET):
        return os.environ[ENV_SECRET]
    path = os.environ.get(ENV_SECRET_FILE)
    if not path:
        return ""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text().strip()
    except OSError as e:
        raise ConfigError(f"{ENV_SECRET_FILE}={path}: cannot read it ({e.strerror}); point it "
                          "at a file holding the run's secret") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{ENV_SECRET_FILE}={path} is readable by other users; "
                          f"chmod 600 {path}")
    if not text:
        raise ConfigError(f"{ENV_SECRET_FILE}={path} is empty; write the run's secret to it")
    return text


def write_secret_file(run_dir: Path) -> tuple[str, Path]:
    """Rank 0 on one machine under torchrun: a fresh secret the other ranks read after the
    rendezvous (which they cannot pass before rank 0 has joined it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SECRET_FILE
    secret = new_secret()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    os.chmod(path, 0o600)
    return secret, path


def read_secret_file(run_dir: Path | None) -> str:
    path = None if run_dir is None else run_dir / SECRET_FILE
    if path is None or not path.is_file():
        raise ConfigError(f"this rank has no secret to join the run with: on several machines "
                          f"set {ENV_SECRET} on each ({HOW_TO_SET})")
    return path.read_text().strip()


def _mac(secret: str, role: bytes, rank: int, nonce: torch.Tensor) -> torch.Tensor:
    digest = hmac.new(secret.encode(), role + rank.to_bytes(4, "little")
                      + nonce.numpy().tobytes(), hashlib.sha256).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def _nonce() -> torch.Tensor:
    return torch.frombuffer(bytearray(secrets.token_bytes(NONCE_BYTES)), dtype=torch.uint8)


def handshake(rank: int, world_size: int, secret: str) -> None:
    """Mutual challenge-response between rank 0 and every other rank (after the process
    group has formed, before any run message). Raises ConfigError naming the rank that
    failed to prove the secret."""
    if rank == 0:
        for peer in range(1, world_size):
            challenge = _nonce()
            reply = torch.empty(NONCE_BYTES + 32, dtype=torch.uint8)
            try:
                dist.send(challenge, peer)
                dist.recv(reply, peer)
            except (RuntimeError, dist.DistError) as e:
                raise ConfigError(f"rank {peer} left before proving this run's secret "
                                  f"({str(e).splitlines()[0][:120]}); see its error above"
                                  ) from None
            ok = hmac.compare_digest(reply[NONCE_BYTES:].numpy().tobytes(),
                                     _mac(secret, b"peer", peer, challenge).numpy().tobytes())
            answer = _mac(secret, b"root", peer, reply[:NONCE_BYTES]) if ok else \
                torch.zeros(32, dtype=torch.uint8)
            dist.send(answer, peer)
            if not ok:
                raise ConfigError(
                    f"rank {peer} did not prove this run's secret: a process that is not part "
                    f"of the run took that rank, or the ranks were started with different "
                    f"{ENV_SECRET}; the run stopped before reading anything from it")
        return
    challenge = torch.empty(NONCE_BYTES, dtype=torch.uint8)
    dist.recv(challenge, 0)
    mine = _nonce()
    dist.send(torch.cat([mine, _mac(secret, b"peer", rank, challenge)]), 0)
    answer = torch.empty(32, dtype=torch.uint8)
    dist.recv(answer, 0)
    if not hmac.compare_digest(answer.numpy().tobytes(),
                               _mac(secret, b"root", rank, mine).numpy().tobytes()):
        raise ConfigError(f"rank 0 did not accept this rank's secret or did not prove its own: "
                          f"the ranks were started with different {ENV_SECRET} ({HOW_TO_SET})")


def join_challenge(link: Link, secret: str, ticket: int) -> bool:
    """Rank 0's side of a joiner's proof over its private link: True when it proved the
    secret (and rank 0 then proved its own); False: refused, answered with zeros. Only the
    fixed-size challenge tensors cross the link: nothing the joiner sends is decoded."""
    challenge = _nonce()
    reply = torch.empty(NONCE_BYTES + 32, dtype=torch.uint8)
    link.send(challenge)
    link.recv(reply)
    ok = hmac.compare_digest(reply[NONCE_BYTES:].numpy().tobytes(),
                             _mac(secret, b"join-peer", ticket, challenge).numpy().tobytes())
    link.send(_mac(secret, b"join-root", ticket, reply[:NONCE_BYTES]) if ok
              else torch.zeros(32, dtype=torch.uint8))
    return ok


def join_respond(link: Link, secret: str, ticket: int) -> None:
    """The joiner's side: prove the secret, and check that rank 0 holds it too."""
    challenge = torch.empty(NONCE_BYTES, dtype=torch.uint8)
    link.recv(challenge)
    mine = _nonce()
    link.send(torch.cat([mine, _mac(secret, b"join-peer", ticket, challenge)]))
    answer = torch.empty(32, dtype=torch.uint8)
    link.recv(answer)
    if not hmac.compare_digest(answer.numpy().tobytes(),
                               _mac(secret, b"join-root", ticket, mine).numpy().tobytes()):
        raise ConfigError(f"the run refused this process's secret (or did not prove its own): "
                          f"use the run's secret ({ENV_SECRET}, {ENV_SECRET_FILE}, or the "
                          f"runs/<name>/{JOIN_SECRET_FILE} a local run writes)")
