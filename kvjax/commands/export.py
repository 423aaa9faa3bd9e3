"""`kvjax export`: write a model (an uptrained or trained run, a GGUF file, a shipped model) as a Hugging
Face checkpoint directory that transformers, vLLM and kvjax itself load."""

from __future__ import annotations

import json

from kvjax.commands.args import MODEL_HELP, check_output
from kvjax.errors import ConfigError

WRITTEN = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def run(args) -> None:
    from kvjax.report import format_bytes
    from kvjax.training.families import exporting
    from kvjax.training.hf_export import export_hf, export_tokenizer
    from kvjax.training.loading import load_model, model_config

    out = check_output(args.dir, "DIR", directory=True)
    if not args.overwrite and (taken := [name for name in WRITTEN if (out / name).exists()]):
        raise ConfigError(f"DIR={out} already holds {', '.join(taken)}; pass --overwrite to replace them")
    cfg = model_config(args.model).model
    exporting(cfg, args.architecture).check_exportable(cfg)  # a model no family expresses fails before loading
    loaded = load_model(args.model)
    tokenizer = loaded.tokenizer
    export_hf(
        loaded.model,
        out,
        args.architecture,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        max_positions=loaded.context or 8192,
    )
    export_tokenizer(tokenizer, out, max_length=loaded.context)
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    sizes = ", ".join(f"{name} ({format_bytes((out / name).stat().st_size)})" for name in WRITTEN)
    print(
        f"wrote {out}: {sizes}; a {architecture} in fp32. Load it with "
        f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}), or kvjax eval {out}"
    )


def register(sub) -> None:
    ex = sub.add_parser(
        "export", help="write a model as a Hugging Face checkpoint directory (config, weights, tokenizer)"
    )
    ex.add_argument("model", help=MODEL_HELP)
    ex.add_argument("dir", metavar="DIR", help="the directory to write (created if missing)")
    ex.add_argument(
        "--architecture",
        help="a Hugging Face family that expresses the model's block, e.g. Phi3ForCausalLM for a Llama-layout "
        "model (default: the family of the block: Llama, Mistral with a sliding window, Qwen3, Gemma 2 or 3)",
    )
    ex.add_argument("--overwrite", action="store_true", help="replace the files of an earlier export in DIR")
    ex.set_defaults(run=run)
