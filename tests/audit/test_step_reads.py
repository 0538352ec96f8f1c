"""The comparison worker's reads of whole steps (``samples_of_steps``, ``fingerprints_of_steps``): in
their documented order, every array bit for bit, and a stored row that cannot be read left out alone,
on SQLite and PostgreSQL (which sends them in binary format)."""

from __future__ import annotations

from sqlalchemy import text

from tests import factories


def test_step_reads_keep_order_and_bits_and_leave_out_an_unreadable_row(store) -> None:
    samples = [
        factories.sample(side, seed=i, step=step)
        for step in (0, 1)
        for i in (2, 0, 1)
        for side in ("rollout", "trainer")
    ]
    prints = [
        factories.fingerprints(s, region, seed=n)
        for n, s in enumerate(samples[:4])
        for region in ("embed", "layers.0")
    ]
    store.ingest(samples)
    store.ingest(prints[::-1])  # recorded order: reversed
    steps = [("run-1", 0), ("run-1", 1)]
    got = store.samples_of_steps(steps)
    for step in (0, 1):
        mine = [s for s in samples if s.step == step]
        want = sorted(mine, key=lambda s: (s.sample_key, s.side))
        assert [(s.sample_key, s.side) for s in got[("run-1", step)]] == [
            (s.sample_key, s.side) for s in want
        ]
        for a, b in zip(got[("run-1", step)], want, strict=True):
            assert (
                a.token_ids.tobytes() == b.token_ids.tobytes()
                and a.logprobs.tobytes() == b.logprobs.tobytes()
            )
            assert (a.prompt_len, a.temperature, a.path, a.rank) == (
                b.prompt_len,
                b.temperature,
                b.path,
                b.rank,
            )
    read = store.fingerprints_of_steps(steps)[("run-1", 0)]
    assert [(p.sample_key, p.side, p.region) for p in read] == [
        (p.sample_key, p.side, p.region) for p in prints[::-1]
    ]
    for a, b in zip(read, prints[::-1], strict=True):
        for name in ("positions", "digest", "ladder", "sketch", "l2", "maxabs"):
            assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name
        assert a.ladder_bits == b.ladder_bits

    bad = "'infinity'::timestamptz" if store.dialect == "postgresql" else "'not a time'"
    with store.sessions.begin() as session:
        victim = samples[1]
        session.execute(
            text(f"UPDATE samples SET created_at = {bad} WHERE step = 0 AND sample_key = :k AND side = :s"),
            {"k": victim.sample_key, "s": victim.side},
        )
        session.execute(
            text(f"UPDATE fingerprints SET created_at = {bad} WHERE region = 'embed' AND step = 0")
        )
    got = store.samples_of_steps(steps)
    assert len(got[("run-1", 0)]) == 5 and len(got[("run-1", 1)]) == 6
    assert (victim.sample_key, victim.side) not in {(s.sample_key, s.side) for s in got[("run-1", 0)]}
    assert [p.region for p in store.fingerprints_of_steps(steps)[("run-1", 0)]] == ["layers.0"] * 4
