"""gpt2lab export: write any model gpt2lab can load as a Hugging Face directory (GPT-2 or NanoChat)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a model as an HF directory (GPT2LMHeadModel or NanoChatForCausalLM; transformers loads it "
        "unchanged)",
        description="SRC is an HF name, an HF model dir, a run dir (newest checkpoint) or a checkpoint dir. "
        "OUT_DIR gets config.json, model.safetensors and the tokenizer files: GPT2LMHeadModel for a model "
        "GPT-2 computes, NanoChatForCausalLM for the modern block with bias false and embed_norm true "
        "(`gpt2lab train --list-presets` says which presets export to what); a padded vocabulary is "
        "trimmed back to the tokenizer's.",
    )
    p.add_argument("src", metavar="SRC", help="model to export (anything --model accepts)")
    p.add_argument(
        "out_dir",
        metavar="OUT_DIR",
        help="directory to write: new, empty, or an earlier gpt2lab export (replaced); "
        "anything else is refused, nothing deleted",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpt2lab.weights.export import check_target, save_pretrained
    from gpt2lab.weights.load import load_model

    check_target(args.out_dir)  # before the model loads: OUT_DIR is refused at once
    model = load_model(args.src, "cpu", arg="SRC")
    target = save_pretrained(model, args.out_dir)
    c = model.config
    print(
        f"wrote {args.out_dir}: {target}, {c.n_layer} layers, {c.n_head} heads, {c.n_embd} wide, "
        f"vocab {c.real_vocab_size}, {model.num_params():,} parameters"
    )
    return 0
