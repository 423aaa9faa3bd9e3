#!/usr/bin/env bash
# A small model that retrieves: the 0.8M-parameter `gqa` shape trained as a chain of runs (train.init),
# then scored by `kvjax eval --task passkey` at 1,000 and 2,000 tokens, full cache and five eviction/selection
# policies keeping 25% and 50% of the tokens.
#   1. induction: random strings repeated at a random period (data.repeats=1), 64-token rows;
#   2. pass keys in KJV filler (data.passkey, answer weighted) with induction rows kept, 256 tokens;
#   3. the same mix at 1,024 tokens;
#   4. the same mix at 2,048 tokens (the model's context), as many tokens a step.
# About 50 minutes on 2 CPU cores. Usage: scripts/train_retrieval.sh [OUT_DIR] (default runs/retrieval).
set -euo pipefail
out=${1:-runs/retrieval}
kvjax=${KVJAX:-.venv/bin/kvjax}
mix="data.passkey=0.5 data.passkey_weight=5 data.repeats=0.25 train.eval_every=100000"

$kvjax train gqa data.repeats=1 data.seq_len=64 train.batch_size=32 \
  train.steps=1500 train.lr=3e-3 train.min_lr_ratio=1 train.warmup_steps=50 train.eval_every=500 --run-dir "$out/1-induction"
$kvjax train gqa train.init="$out/1-induction" $mix data.seq_len=256 \
  train.batch_size=32 train.steps=400 train.lr=1e-3 train.min_lr_ratio=1 train.warmup_steps=20 --run-dir "$out/2-passkey-256"
$kvjax train gqa train.init="$out/2-passkey-256" $mix data.seq_len=1024 \
  train.batch_size=8 train.steps=400 train.lr=1e-3 train.min_lr_ratio=1 train.warmup_steps=20 --run-dir "$out/3-passkey-1024"
$kvjax train gqa train.init="$out/3-passkey-1024" $mix data.seq_len=2048 \
  train.batch_size=4 train.steps=600 train.lr=1e-3 train.min_lr_ratio=1 train.warmup_steps=20 --run-dir "$out/4-passkey-2048"
$kvjax eval "$out/4-passkey-2048" --task passkey --lengths 1000 2000 --trials 16 --policy streaming:0.75 \
  --policy h2o:0.75 --policy snapkv:0.75 --policy quest:0.75 --policy tova:0.75
$kvjax eval "$out/4-passkey-2048" --task passkey --lengths 1000 2000 --trials 16 --policy streaming:0.5 \
  --policy h2o:0.5 --policy snapkv:0.5 --policy quest:0.5 --policy tova:0.5
