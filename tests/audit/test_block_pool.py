"""Token blocks measured in other processes (``audit.metrics.block_pool``): the same bits as one
lane, whatever happens to the pool's processes, and nothing left behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from isoaudit.audit.metrics.block_pool import BlockPool, active_pool, measuring_in
from isoaudit.audit.metrics.blocks import TokenBlocks

from tests.audit.test_blocks import bits, every_reduction, mixed_step


@pytest.fixture(scope="module")
def pool_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("blocks")


def measured_in(
    pool: BlockPool | None, t: np.ndarray, r: np.ndarray, o: np.ndarray, **kwargs: object
) -> dict:
    requests = every_reduction(t, r, o).keys()
    blocks = TokenBlocks(t, r, o, block_tokens=600, **kwargs)  # type: ignore[arg-type]
    with measuring_in(pool):
        blocks.measure(requests, threads=2)
    return bits(blocks._done)


def test_a_pool_gives_the_bits_of_one_lane_and_leaves_no_file(pool_dir: Path) -> None:
    t, r, o = mixed_step(3)
    one_lane = bits(every_reduction(t, r, o))
    with BlockPool(1, directory=str(pool_dir)) as pool:
        assert measured_in(pool, t, r, o) == one_lane
        assert pool.failures == 0, pool.last_failure
        assert pool.blocks > 0
    with BlockPool(2, directory=str(pool_dir)) as pool:  # three lanes
        assert measured_in(pool, t, r, o) == one_lane
        assert pool.failures == 0, pool.last_failure
    assert list(pool_dir.iterdir()) == []


def test_tokens_that_are_not_finite_go_to_the_pool_as_they_are(pool_dir: Path) -> None:
    t, r, o = mixed_step(4)
    r[[5, 900, 2500]] = [-np.inf, np.nan, -np.inf]
    requests = every_reduction(t, r, o).keys()
    alone = TokenBlocks(t, r, o, finite_only=True)
    alone.measure(requests)
    with BlockPool(1, directory=str(pool_dir)) as pool:
        assert measured_in(pool, t, r, o, finite_only=True) == bits(alone._done)
        assert pool.failures == 0, pool.last_failure


def test_a_killed_process_costs_the_pool_its_share_not_the_pass(pool_dir: Path) -> None:
    t, r, o = mixed_step(5)
    one_lane = bits(every_reduction(t, r, o))
    with BlockPool(1, directory=str(pool_dir)) as pool:
        assert measured_in(pool, t, r, o) == one_lane
        for pid in pool.pids:  # the pool's process dies between passes
            os.kill(pid, signal.SIGKILL)
        assert measured_in(pool, t, r, o) == one_lane  # measured here instead
        assert pool.failures == 1 and pool.last_failure is not None
        assert measured_in(pool, t, r, o) == one_lane  # a fresh process took over
        assert pool.failures == 1, pool.last_failure
    assert list(pool_dir.iterdir()) == []


def test_a_closed_pool_measures_here(pool_dir: Path) -> None:
    t, r, o = mixed_step(6)
    pool = BlockPool(1, directory=str(pool_dir))
    pool.close()
    assert measured_in(pool, t, r, o) == bits(every_reduction(t, r, o))
    assert pool.failures == 1 and "closed" in (pool.last_failure or "")


def test_a_pool_is_used_only_where_it_is_made_active(pool_dir: Path) -> None:
    assert active_pool() is None
    with BlockPool(1, directory=str(pool_dir)) as pool:
        with measuring_in(pool):
            assert active_pool() is pool
        assert active_pool() is None
    with pytest.raises(ValueError, match="processes"):
        BlockPool(0)


def test_a_stuck_process_is_replaced(pool_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from isoaudit.audit.metrics import block_pool

    t, r, o = mixed_step(7)
    one_lane = bits(every_reduction(t, r, o))
    monkeypatch.setattr(block_pool, "TIMEOUT_S", 0.5)
    with BlockPool(1, directory=str(pool_dir)) as pool:
        (stuck,) = pool.pids
        os.kill(stuck, signal.SIGSTOP)
        assert measured_in(pool, t, r, o) == one_lane
        assert pool.failures == 1 and "TimeoutError" in (pool.last_failure or "")
        assert pool.pids != [stuck]
        monkeypatch.setattr(block_pool, "TIMEOUT_S", 120.0)  # the fresh process may still be importing
        assert measured_in(pool, t, r, o) == one_lane and pool.failures == 1


def test_a_script_without_a_main_guard_runs_once(tmp_path: Path) -> None:
    """The pool's processes import isoaudit alone, never the caller's script (multiprocessing's
    spawn and forkserver would run an unguarded training script again in each child)."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np\n"
        "from isoaudit.audit.metrics.block_pool import BlockPool, measuring_in\n"
        "from isoaudit.audit.metrics.blocks import TokenBlocks\n"
        "print('job ran', flush=True)\n"
        "t = -np.random.default_rng(0).random(3000).astype(np.float32)\n"
        "blocks = TokenBlocks(t, t * 1.001, np.array([0, 1000, 2000, 3000]), block_tokens=1000)\n"
        "with BlockPool(1) as pool, measuring_in(pool):\n"
        "    blocks.measure([('sum', 'd')], threads=2)\n"
        "    assert pool.blocks > 0 and pool.failures == 0, pool.last_failure\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("job ran") == 1


def test_no_room_for_the_tokens_costs_the_share_not_the_process(
    pool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory too full for the tokens (a small /dev/shm) fails the reservation, never a write
    into the mapping (SIGBUS); the blocks are measured here and the process stays."""
    import errno

    from isoaudit.audit.metrics import block_pool

    t, r, o = mixed_step(8)
    one_lane = bits(every_reduction(t, r, o))

    def full(fd: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with BlockPool(1, directory=str(pool_dir)) as pool:
        before = pool.pids
        monkeypatch.setattr(block_pool, "_reserve", full)
        assert measured_in(pool, t, r, o) == one_lane
        assert pool.failures == 1 and "No space" in (pool.last_failure or "")
        assert pool.pids == before
        monkeypatch.undo()
        assert measured_in(pool, t, r, o) == one_lane and pool.failures == 1 and pool.blocks > 0
    assert list(pool_dir.iterdir()) == []
