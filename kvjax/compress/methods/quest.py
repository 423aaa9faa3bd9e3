"""Quest (Tang et al. 2024, arXiv 2406.10774, sec. 3): nothing is evicted; the cache also keeps each
page's channel-wise key min and max, and a decode query reads only the pages whose upper bound on q.k
is highest (`kvjax.cache.QuestKVCache`). The budget is the tokens read per decode step, in whole pages,
fixed at the prefill as the paper's token budget: a ratio is of the prompt (so `quest:0.0` reads the
prompt's pages, not the pages decoding adds), and a size may exceed the prompt (`quest:4096` on a
1,000-token prompt reads every page until the sequence passes 4,096 tokens)."""

from __future__ import annotations

import dataclasses

from kvjax.cache import QuestKVCache
from kvjax.compress.methods.base import Method, Options, register


@register
class Quest(Method):
    name = "quest"
    kind = "selector"
    head_keys = True
    alone = "it selects pages at attention time"

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        page_size: int = 16  # tokens per page

        def check(self, where):
            self.at_least_one(where, "page_size")

    def keep_cap(self, stage, cap):
        return -(-cap // stage.options.page_size) * stage.options.page_size  # whole pages are read

    def encode(self, stage, cache, stat, target):
        return QuestKVCache.from_cache(cache, stage.options.page_size, target.keep_cap // stage.options.page_size)

    def cache_bytes(self, stage, target, mem, K, item, positions, source):
        # every slot kept, plus a key min and max per page and head
        return mem.bytes(source) + -(-source // stage.options.page_size) * mem.kv_bytes_per_slot
