import sysconfig

import pytest

from kvjax.config import load_config

# A few real files (the json package's source) keep unit-test corpora small and offline.
SMALL_CORPUS = f"text:{sysconfig.get_paths()['stdlib']}/json/*.py"


# A 2-layer model on that corpus, in 32-token windows (the unit tests' runs, with their train.* settings).
SMALL_RUN = (
    "model.n_layers=2",
    f"data.corpus={SMALL_CORPUS}",
    "data.seq_len=32",
    "data.val_fraction=0.3",
    "data.eval_windows=8",
)


@pytest.fixture
def small_config():
    """A 2-layer GQA model on a tiny corpus; extra overrides win."""

    def make(*overrides: str):
        base = [
            *SMALL_RUN,
            "train.batch_size=4",
            "train.steps=8",
            "train.warmup_steps=1",
            "train.checkpoint_every=4",
            "train.eval_every=4",
            "train.log_every=1000",
        ]
        return load_config("gqa", [*base, *overrides])

    return make
