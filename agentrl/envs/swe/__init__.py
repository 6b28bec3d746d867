"""Software-engineering tasks: the SWE-bench instance layout, offline synthetic tasks, and
grading by running the task's tests in a sandbox (reward 1 iff every FAIL_TO_PASS test now
passes and every PASS_TO_PASS test still does)."""
