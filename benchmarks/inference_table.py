"""The Markdown tables of benchmarks/inference_cpu.sh's outputs: python benchmarks/inference_table.py OUT_DIR"""

from __future__ import annotations

import json
import pathlib
import re
import statistics
import sys


def _read(out: pathlib.Path) -> dict:
    return {
        p.stem: json.loads(p.read_text().strip().splitlines()[-1])
        for p in sorted(out.glob("*.json"))
        if p.read_text().strip()
    }


def _held(run: dict) -> str:
    return f"{run['inference']['dtype']}/{run['inference']['kernel']}"


def sample_tables(runs: dict) -> None:
    auto = runs.get("sample-auto")
    if auto:
        t, ct = auto["tok_per_s"], auto.get("ctranslate2_tok_per_s", {})
        print(
            f"Default (`{_held(auto)}`): **{t['sample']:.1f}** tok/s; "
            f"`generate()` {t['generate']:.1f}; unprepared under autocast {t['unprepared']:.1f}; "
            f"transformers {t.get('transformers', 0):.1f}; "
            + "; ".join(f"CTranslate2 {k} {v:.1f}" for k, v in ct.items() if isinstance(v, float))
            + "\n"
        )
    for name in ("sample-settings", "sample-int8"):
        r = runs.get(name)
        if not r:
            continue
        t = r["tok_per_s"]
        print(f"| {name}: way | tok/s (best of {len(r['seconds']['sample'])}) | vs the default |")
        print("| --- | --- | --- |")
        for way, v in t.items():
            if v:
                label = f"default ({_held(r)})" if way == "sample" else way
                print(f"| {label} | {v:.1f} | {v / t['sample']:.2f}x |")
        for k, v in r.get("ctranslate2_tok_per_s", {}).items():
            if isinstance(v, float):
                print(f"| CTranslate2 {k} | {v:.1f} | {v / t['sample']:.2f}x |")
        print()


def serve_table(runs: dict) -> None:
    by: dict[str, list[dict]] = {}
    for name, r in runs.items():
        m = re.fullmatch(r"serve-(.+)-r(\d+)", name)
        if m:
            by.setdefault(m.group(1), []).append(r)
    if not by:
        return
    print("| `bench serve` setting | held as | 1 stream tok/s (median; runs) | 8 streams tok/s (median; runs) |")
    print("| --- | --- | --- | --- |")
    for setting, rs in by.items():
        vals = {n: [next(x["aggregate_tok_per_s"] for x in r["load"] if x["streams"] == n) for r in rs] for n in (1, 8)}
        held = ", ".join(sorted({_held(r) for r in rs}))
        print(
            f"| {setting} | {held} | "
            + " | ".join(f"**{statistics.median(v):.1f}** ({', '.join(f'{x:.0f}' for x in v)})" for v in vals.values())
            + " |"
        )
        for r in rs:
            ct2 = {c["rows"]: c["aggregate_tok_per_s"] for c in r.get("ctranslate2", [])}
            for kind in ("float32", "int8", "bfloat16"):
                if all(isinstance(ct2.get(n, {}).get(kind), float) for n in (1, 8)):
                    row = f"| CTranslate2 {kind}: a 1-row and an 8-row batch | | {ct2[1][kind]:.1f} |"
                    print(f"{row} {ct2[8][kind]:.1f} |")


def main() -> None:
    runs = _read(pathlib.Path(sys.argv[1]))
    sample_tables(runs)
    serve_table(runs)


if __name__ == "__main__":
    main()
