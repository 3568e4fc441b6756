"""Loads a page seqpar wrote in headless Chromium and checks what a person would see.

    check_page.py PAGE.html SCREENSHOT.png SNIPPET...

Passes when: the page references nothing outside itself (no http(s) src/href: it must open
offline), Chromium loads it without a console error or an uncaught exception, the DOM Chromium
built holds every SNIPPET (an element, a class, a text), and the screenshot is not blank (more
than 1 % of its pixels differ from the background, in more than 3 colours). Prints the page's
size. Exit 0 ok, 1 a check failed, 77 (skip) when no Chromium is installed."""
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def png_pixels(path):
    """(width, height, rows of RGB(A) tuples) of an 8-bit RGB/RGBA PNG (what Chromium writes)."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            if depth != 8 or colour not in (2, 6):
                raise ValueError(f"PNG depth {depth} colour type {colour} not read here")
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, channels, rows


def main():
    page, shot, snippets = os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3:]
    exe = chromium()
    if not exe:
        print("skip: no chromium installed (setup.sh test installs it)")
        return 77
    text = open(page, encoding="utf-8").read()
    errors = []
    outside = re.findall(r'(?:src|href)\s*=\s*"(https?:[^"]*)"', text)
    if outside:
        errors.append(f"references outside the page: {outside[:3]}")
    base = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--no-first-run", "--disable-extensions", "--enable-logging=stderr", "--v=0"]
    with tempfile.TemporaryDirectory() as profile:
        run = lambda extra: subprocess.run(
            [exe, *base, f"--user-data-dir={profile}", *extra, "file://" + page],
            capture_output=True, text=True, timeout=120)
        dom = run(["--dump-dom"])
        shot_run = run([f"--screenshot={os.path.abspath(shot)}", "--window-size=1280,1400"])
    logs = dom.stderr + shot_run.stderr
    console = [l for l in logs.splitlines()
               if re.search(r"CONSOLE[:(]|Uncaught", l)]
    if console:
        errors.append(f"console: {console[:3]}")
    if dom.returncode != 0 or not dom.stdout.strip():
        errors.append(f"chromium --dump-dom failed (exit {dom.returncode}): {logs[-300:]}")
    for s in snippets:
        if s not in dom.stdout:
            errors.append(f"the page lacks {s!r}")
    if not os.path.exists(shot):
        errors.append(f"no screenshot (exit {shot_run.returncode}): {logs[-300:]}")
    else:
        w, h, ch, rows = png_pixels(shot)
        background = rows[0][:ch]
        differ, colours = 0, set()
        for row in rows[::4]:
            for x in range(0, w * ch, ch * 4):
                px = row[x:x + ch]
                if px != background:
                    differ += 1
                    if len(colours) < 64:
                        colours.add(px)
        sampled = (h // 4 + 1) * (w // 4 + 1)
        if differ < 0.01 * sampled or len(colours) <= 3:
            errors.append(f"the screenshot is blank: {differ} of {sampled} sampled pixels "
                          f"differ from the background, {len(colours)} colours")
    if errors:
        print("\n".join(f"{page}: {e}" for e in errors))
        return 1
    print(f"ok: {os.path.basename(page)} {len(text.encode())} bytes, {len(snippets)} elements, "
          f"screenshot {shot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
