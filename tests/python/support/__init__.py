"""What the tests share, apart from the tests themselves: log factories (logfactory), the
reader's fuzzer (fuzzing), the small training loop (training), real-shaped loops also run
as scripts (gan_loop, gpt_loop, framework_loops, ddp_slow_rank) and the fake NCCL of the
collective tests (fake_nccl). conftest.py puts tests/python on sys.path, so a test
imports them as ``from support import logfactory`` or ``from support.training import train``."""
