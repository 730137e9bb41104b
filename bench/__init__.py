"""Maintained benchmarks, each run from the repository root as `python -m bench.<name>`: kda, moe,
dsa, select_tokens and model_gpu on a GPU; decode_compile (on a GPU, or for a compile-only H200);
sharded_compile (8 compile-only H200s). Each appends its result rows to bench/results.jsonl
(`common.Results`); `python -m bench.speed_table` writes the README's speed tables from that file.
bench/RESULTS.md is the dated log of the runs."""
