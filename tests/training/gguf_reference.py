"""transformers' model and tokenizer read from a shipped GGUF file: the independent reference for kvjax's
GGUF import."""

from pathlib import Path

import pytest

from kvjax.training.gguf_import import gguf_reader, resolve_gguf


def transformers_from_gguf(name: str):
    """(model in fp32, tokenizer) as transformers loads them from the file. transformers parses the file's
    metadata with the gguf package three times (config, weights, tokenizer: 72 s of its 115 s for Gemma 3);
    it is handed the parse kvjax made (read-only), and maps, dequantizes and converts the tokenizer its own
    way."""
    import gguf
    import torch
    import transformers

    path = resolve_gguf(name)
    kw = dict(gguf_file=path.name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", lambda p, *a, **k: gguf_reader(Path(p)))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw)
        return model.eval(), transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
