"""A real browser's view of an HTML page, for tests: a headless Chromium screenshot, and a
PNG decoder small enough to check what was drawn (no imaging dependency).

`chromium()` finds the browser (Debian's `chromium` package, which `make test` installs);
`screenshot(html, png)` renders a page; `png_rgb(png)` returns (width, height, an RGB array).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--hide-scrollbars")


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(html: Path, png: Path, size: tuple[int, int] = (1280, 1800),
               timeout: float = 120) -> None:
    browser = chromium()
    if browser is None:
        raise FileNotFoundError("no chromium on PATH (apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as profile:
        cmd = [browser, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
               f"--window-size={size[0]},{size[1]}", Path(html).resolve().as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if not Path(png).exists():
        raise RuntimeError(f"chromium wrote no screenshot (exit {proc.returncode}): "
                           f"{proc.stderr[-2000:]}")


def png_rgb(path: Path):
    """Decode an 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes): (width,
    height, a uint8 array [height, width, 3])."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    width = height = color = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            assert depth == 8 and color in (2, 6) and interlace == 0, "unsupported PNG"
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    import numpy as np

    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8)
    stride = width * bpp
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.int64)
    for y in range(height):
        f = int(raw[y * (stride + 1)])
        line = raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)].astype(np.int64)
        if f == 1:      # Sub: a running sum per channel
            line = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) % 256
        elif f == 2:    # Up
            line = (line + prev) % 256
        elif f in (3, 4):   # Average, Paeth: sequential along the row
            cur = line.tolist()
            up = prev.tolist()
            for i in range(stride):
                a = cur[i - bpp] if i >= bpp else 0
                b = up[i]
                if f == 3:
                    cur[i] = (cur[i] + (a + b) // 2) & 255
                else:
                    c = up[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc
                                        else c)) & 255
            line = np.array(cur, dtype=np.int64)
        out[y] = line
        prev = line
    return width, height, out.reshape(height, width, bpp)[:, :, :3]
