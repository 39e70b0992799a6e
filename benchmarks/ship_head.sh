#!/usr/bin/env bash
# Make a head trained on the device the shipped EAGLE3 default:
#   bash benchmarks/ship_head.sh FILES_DIR NAME
# FILES_DIR holds a trained head brought back from a GPU host (NAME_meta.tar with config.json,
# README.md and training.json; NAME_model.safetensors.part*: the weights split under a transfer cap). The weights are put together,
# drafted with once (CPU is enough), and replace engine/drafts/checkpoints/<shipped>/ stored in fp8.
# Then: python -m pytest -q tests/test_train_draft.py -k shipped, add the end-to-end rows to the card,
# and commit the weights once.
set -euo pipefail
src=$1 name=$2
dst=engine/drafts/checkpoints/smollm2-135m-instruct-eagle3
tmp=$(mktemp -d)
tar -C "$tmp" -xf "$src/${name}_meta.tar"
cat "$src/${name}_model.safetensors.part"* > "$tmp/model.safetensors"
# the head drafts for the target (CPU is enough): one prompt, its output the target's own
python -m pipeline +experiment=eagle3 draft.path="$tmp" eval.limit=1 eval.max_new_tokens=32 tracking=off \
  | grep -E "^(accept_length|match_baseline)"
rm -rf "$dst" && mkdir -p "$dst"
cp "$tmp"/config.json "$tmp"/model.safetensors "$tmp"/README.md "$tmp"/training.json "$dst"/
python -m engine.drafts.storage "$dst" "$dst" --dtype fp8  # the shipped form (engine/drafts/storage.py)
du -b "$dst"/* | sort -n
