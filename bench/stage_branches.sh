#!/bin/bash
# Unpacks the code of each named branch into variants/<branch>, untracked (so it travels to the device
# machine with the working tree), for one device call that runs them side by side, e.g.
#     bench/stage_branches.sh main intra-grid-order decode-grid-order
#     # on the device machine:
#     for v in variants/*; do (cd $v && PYTHONPATH=$PWD:$PWD/bench python3 bench/kda_parts.py); done
# Delete variants/ afterwards; never commit it.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for branch in "$@"; do
    rm -rf "variants/$branch"
    mkdir -p "variants/$branch"
    git archive "$branch" glm5next_jax pallas_kernels bench | tar -x -C "variants/$branch"
done
