"""What several test modules share: a test module imports these, never another test module or `tests.conftest`
(which keeps only fixtures, hooks and the environment set before JAX starts)."""
