"""Build the measurement text of "Your own tokenizer" (docs/benchmarks.md) from this machine's files.

    python benchmarks/tokenizer_data.py OUT [--code-mb 4] [--deb debian-reference-de_*.deb]

OUT/code: the Python standard library's own .py files (this interpreter's, ``sysconfig``'s stdlib,
without site-packages, tests and caches), one JSON line per file ({"text", "path"}), in the order of
their paths. A file is held out when the sha256 of its path ends in a 0 nibble (about 1 in 16): those
go to 0_heldout.jsonl, the first --code-mb MB of the others to 1_train.jsonl.

OUT/german: the German Debian Reference (Debian package debian-reference-de, GPL-2+, its copyright
file copied beside), the plain-text edition cut into its numbered sections (short ones joined to the
next, at least 2,000 characters); every tenth section is held out. The package is fetched with
``apt-get download`` unless --deb names it.

Same machine, same files: the same bytes. Held-out files come first in name order, so
``gpt2lab prepare --source OUT/code --val-tokens N`` with N their tokens makes them the val split.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from gpt2lab.system.files import atomic_write

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
GERMAN_TXT = "usr/share/debian-reference/debian-reference.de.txt.gz"
COPYRIGHT = "usr/share/doc/debian-reference-de/copyright"
SECTION = re.compile(r"^\d+(\.\d+)+\. ", re.M)  # "1.2.6. Zeitstempel": a numbered section starts
MIN_SECTION = 2000  # characters: the contents' one-line entries are grouped into sections this long


def write_jsonl(path: str, rows: list[dict]) -> int:
    with atomic_write(path, "wb") as f:  # whole or not at all, as every file gpt2lab writes
        for row in rows:
            f.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
    return sum(len(r["text"].encode()) for r in rows)


def code(out: str, megabytes: float) -> dict:
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        paths += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")]
    held, train, budget, unreadable = [], [], megabytes * 1e6, 0
    for rel in sorted(paths):
        try:
            text = Path(root, rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            unreadable += 1
            continue
        row = {"text": text, "path": rel}
        if hashlib.sha256(rel.encode()).hexdigest().endswith("0"):
            held.append(row)
        elif budget > 0:
            train.append(row)
            budget -= len(text.encode())
    os.makedirs(out, exist_ok=True)
    return {
        "stdlib": root,
        "python": sys.version.split()[0],
        "unreadable_files": unreadable,
        "heldout": {"files": len(held), "bytes": write_jsonl(os.path.join(out, "0_heldout.jsonl"), held)},
        "train": {"files": len(train), "bytes": write_jsonl(os.path.join(out, "1_train.jsonl"), train)},
    }


def german(out: str, deb: str | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if deb is None:
            download = ["apt-get", "download", "debian-reference-de"]
            subprocess.run(download, cwd=tmp, check=True, stdout=subprocess.DEVNULL)
            deb = os.path.join(tmp, next(f for f in os.listdir(tmp) if f.endswith(".deb")))
        subprocess.run(["dpkg-deb", "-x", deb, os.path.join(tmp, "x")], check=True)
        with gzip.open(os.path.join(tmp, "x", GERMAN_TXT), "rt", encoding="utf-8") as f:
            text = f.read()
        os.makedirs(out, exist_ok=True)
        with atomic_write(os.path.join(out, "copyright"), "wb") as dst:
            dst.write(Path(tmp, "x", COPYRIGHT).read_bytes())
    starts = [m.start() for m in SECTION.finditer(text)]
    sections, doc = [], ""
    for a, b in zip([0, *starts], [*starts, len(text)]):  # a short section (a contents line) joins the next
        doc += text[a:b]
        if len(doc) >= MIN_SECTION or b == len(text):
            sections.append(doc)
            doc = ""
    held = [{"text": s} for i, s in enumerate(sections) if i % 10 == 9]
    train = [{"text": s} for i, s in enumerate(sections) if i % 10 != 9]
    return {
        "package": os.path.basename(deb),
        "licence": "GPL-2+ (copyright file beside the text)",
        "heldout": {"sections": len(held), "bytes": write_jsonl(os.path.join(out, "0_heldout.jsonl"), held)},
        "train": {"sections": len(train), "bytes": write_jsonl(os.path.join(out, "1_train.jsonl"), train)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--code-mb", type=float, default=4.0, help="MB of training code (default 4)")
    p.add_argument("--deb", help="a debian-reference-de .deb already at hand")
    args = p.parse_args()
    summary = {
        "code": code(os.path.join(args.out, "code"), args.code_mb),
        "german": german(os.path.join(args.out, "german"), args.deb),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
