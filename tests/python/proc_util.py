"""A child process for cross-process tests: started with spawn (no inherited state), and at the
end of the block joined and required to have exited cleanly, or killed if the block failed."""
import contextlib
import multiprocessing as mp


@contextlib.contextmanager
def spawned(target, *args, timeout: float = 60):
    p = mp.get_context("spawn").Process(target=target, args=args)
    p.start()
    try:
        yield p
        p.join(timeout)
        assert p.exitcode == 0, f"{target.__name__} exited with {p.exitcode}"
    finally:
        if p.is_alive():
            p.kill()
            p.join(5)


def queues(n: int = 2):
    """``n`` queues a spawned child can use."""
    ctx = mp.get_context("spawn")
    return tuple(ctx.Queue() for _ in range(n))
