"""StreamingLLM (Xiao et al. 2024, arXiv 2309.17453): the attention sinks (the first 4 positions) and
the most recent tokens; the score is recency, and every kept token is a sink or in the window."""

from kvjax.compress.methods.base import Method, register, slot_positions


@register
class Streaming(Method):
    name = "streaming"
    pageable = True
    sinks = 4

    def window(self, stage, keep):
        return max(0, keep - stage.n_sinks)  # the rest of the budget

    def score(self, stage, cache, stat, last_pos):
        return slot_positions(cache).astype("float32")
