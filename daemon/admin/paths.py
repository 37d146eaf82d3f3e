"""Where the admin socket lives when `admin.socket_path` is left at its default.

The default, `/run/tokenloom/admin.sock`, is systemd's RuntimeDirectory. A daemon started by
hand on a laptop (`make serve`) cannot create `/run/tokenloom`, so it falls back to a
per-user directory: `$XDG_RUNTIME_DIR/tokenloom/admin.sock`, or, when XDG_RUNTIME_DIR is
unset, `<tmp>/tokenloom-<uid>/admin.sock`. The directory is created mode 0700 and must be
owned by us (a directory someone else planted in /tmp is refused). `tokenloom admin` looks
in the same places, in the same order, so a newcomer's `tokenloom admin stats` finds a
`make serve` daemon without any option.

A path set explicitly in the config is used as it is: no fallback.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from tokenloom.config.schema import DEFAULT_ADMIN_SOCKET

PRIMARY = DEFAULT_ADMIN_SOCKET


def fallback_path(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR", "")
    base = Path(runtime) / "tokenloom" if runtime else \
        Path(tempfile.gettempdir()) / f"tokenloom-{os.getuid()}"
    return str(base / "admin.sock")


def candidates(configured: str, env: Mapping[str, str] | None = None) -> list[str]:
    """The paths to try, in order: the configured one, plus the fallback at the default."""
    if configured != DEFAULT_ADMIN_SOCKET:
        return [configured]
    return [PRIMARY, fallback_path(env)]


def ensure_private_dir(path: str) -> None:
    """Create the socket's directory (0700) or check that an existing one is ours and
    private; OSError otherwise."""
    d = Path(path).parent
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(13, f"{d} must be a directory owned by uid {os.getuid()} with "
                                  f"mode 0700 (found uid {st.st_uid}, mode "
                                  f"{stat.S_IMODE(st.st_mode):o})")


def find_socket(configured: str, env: Mapping[str, str] | None = None) -> str:
    """For the CLI: the first candidate that is a socket, else the first candidate (so the
    error message names the path the daemon would use under systemd)."""
    paths = candidates(configured, env)
    for p in paths:
        try:
            if stat.S_ISSOCK(os.stat(p).st_mode):
                return p
        except OSError:
            continue
    return paths[0]
