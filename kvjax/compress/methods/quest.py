"""Quest (Tang et al. 2024, arXiv 2406.10774, sec. 3): nothing is evicted; the cache also keeps each
page's channel-wise key min and max, and a decode query reads only the pages whose upper bound on q.k
is highest (`kvjax.cache.QuestKVCache`). The budget is the tokens read per decode step, in whole pages,
fixed at the prefill as the paper's token budget: a ratio is of the prompt (so `quest:0.0` reads the
prompt's pages, not the pages decoding adds), and a size may exceed the prompt (`quest:4096` on a
1,000-token prompt reads every page until the sequence passes 4,096 tokens). On a sliding-window ring
(`local=true`) the pages are those of the tokens still in the window and the ones decoding adds, a page
wholly out of the window is no candidate, and a size of at least the window reads every page; the pages
form a ring (`kvjax.cache.WindowQuestKVCache`) of the ceil((W - 1) / page_size) + 1 pages that W consecutive
tokens can touch, so the cache stays capped however long decoding goes.

Deviation, known: the budget is the stage's keep cap, so where prompts of one bucket share a compile
(`Generator.compression_plan(sized_for=)`: `prefill_shared`, `answer`, RULER's sweeps) it is the bucket's, not the
prompt's, up to one bucket's rounding more pages (a 2,000-token prompt in the 2,048 bucket at `quest:0.5` reads
64 pages of 16, not 63). `Generator.__call__` and the engine's pages (`kvjax.paged_quest`) read the prompt's own."""

from __future__ import annotations

import dataclasses

from kvjax.cache import QuestKVCache, WindowQuestKVCache
from kvjax.compress.methods.base import Method, Options, register


@register
class Quest(Method):
    name = "quest"
    kind = "selector"
    head_keys = True
    pageable = True  # its pages are the engine's, with their key bounds (`kvjax.paged_quest`)
    alone = "it selects pages at attention time"

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        page_size: int = 16  # tokens per page

        def check(self, where):
            self.at_least_one(where, "page_size")

    def keep_cap(self, stage, cap):
        return -(-cap // stage.options.page_size) * stage.options.page_size  # whole pages are read

    def encode(self, stage, cache, stat, target):
        cache = cache.resized(self.slots(stage, target, cache.capacity))  # a ring's window plus the tokens to come
        pages = target.keep_cap // stage.options.page_size
        if target.window is not None and target.keep_cap >= target.window:  # reads the whole window: every page
            pages = -(-cache.capacity // stage.options.page_size)
        quest = QuestKVCache.from_cache(cache, stage.options.page_size, pages)
        return quest if target.window is None else WindowQuestKVCache.of(quest)

    def slots(self, stage, target, source: int) -> int:
        """Slots stored of a cache of `source`: every token; a ring's (`Target.source`) in whole pages, at most
        those that hold every page the window touches whole (so each page the ring reads is the page a growing
        cache would read: W + page_size - 1 slots, rounded up to pages)."""
        slots, ps = target.source(source), stage.options.page_size
        if target.window is None:
            return slots
        return target.capped(-(-slots // ps) * ps, (-(-(target.window - 1) // ps) + 1) * ps)

    def cache_bytes(self, stage, target, mem, K, item, positions, source):
        # every slot kept, plus a key min and max per page and head
        slots = self.slots(stage, target, source)
        return mem.bytes(slots) + -(-slots // stage.options.page_size) * mem.kv_bytes_per_slot
