"""Offline tools, each run from the repository root as `python -m tools.<name>`: lowered_kernels
(every kernel lowered for an H200 as text, to compare two trees), kda_lowered (the scan's SMEM requests
and module sizes), kda_ptxas (the Triton decode kernels' registers and spills by ptxas, no GPU),
kda_ptx (the scan's PTX by loop, from a dump on the GPU or an earlier one), kda_profile (the KDA
kernels once each, for Nsight Compute); and stage_branches.sh (branches unpacked side by side for
one device call)."""
