export XLA_FLAGS="--xla_dump_to=/tmp/xdump --xla_gpu_dump_llvmir=true"
PYTHONPATH=$PWD:$PWD/bench python3 - <<'PY' 2>&1 | grep -v "^WARNING\|^I0000\|^E0000"
import jax, jax.numpy as jnp
import kda as bench
from pallas_kernels import kda, kda_triton
x = kda.random_decode_inputs(jax.random.key(0), 64, 64, 128, state_scale=0.01)
fixed = {k_: v_ for k_, v_ in x.items() if k_ not in ("conv_state", "state")}
step = lambda c, s: kda_triton.decode_step(conv_state=c, state=s, **fixed, lower_bound=-5.0)[1:]
print("chain", bench.chain_ms(step, (x["conv_state"] + 0, x["state"] + 0), n=4, reps=3))
PY
unset XLA_FLAGS
find /tmp/xdump -type f | grep -v "jit__normal\|jit_multiply" | sed 's|/tmp/xdump/||' | head -60
grep -rl "kda_decode_step" /tmp/xdump | head -20
for f in $(grep -rl "kda_decode_step" /tmp/xdump | grep -i "ptx\|thunk\|\.ll" | head -6); do cp $f $OUT/; done
ls -la $OUT
