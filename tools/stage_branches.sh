#!/bin/bash
# Unpacks the code of each named branch or commit into variants/<name>, untracked (so it travels to the
# device machine with the working tree), for one device call that runs them side by side, e.g.
#     tools/stage_branches.sh main my-branch
#     # on the device machine (each run writes its rows beside its own code):
#     for v in variants/*; do (cd $v && python3 -m bench.kda --skip check --no-peers); done
# Delete variants/ afterwards; never commit it.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for branch in "$@"; do
    rm -rf "variants/$branch"
    mkdir -p "variants/$branch"
    paths=(glm5next_jax pallas_kernels bench)
    if git cat-file -e "$branch:tools" 2>/dev/null; then paths+=(tools); fi
    git archive "$branch" "${paths[@]}" | tar -x -C "variants/$branch"
done
