"""One module per kernel: a pure-jnp reference beside each Pallas GPU kernel, behind one call."""
