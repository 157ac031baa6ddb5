"""A spare makes its snapshot slots while it waits (snapshot/spare_slots.py): real shared memory, a real store."""
from __future__ import annotations

import os
import secrets

import pytest

from deadpool_ext.memory.shm import job_shm_dir
from deadpool_ext.snapshot import spare_slots
from deadpool_ext.store import connect
from deadpool_ext.store.embedded import EmbeddedStoreServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store():
    token = secrets.token_urlsafe(16)
    with EmbeddedStoreServer(token=token) as server:
        yield connect(server.url, token, "spjob", 10.0)
    spare_slots.release()
    spare_slots._state.update(done=False, next=0.0)


def test_a_waiting_spare_makes_two_touched_slots_of_the_largest_size_and_takes_them_at_its_restore(store, shm_root):
    spare_slots.tick(store, shm_root, "spjob", "spare0", 1)
    d = job_shm_dir(shm_root, "spjob", "spare0")
    assert not os.path.exists(d)                      # no size published yet: nothing made
    spare_slots.publish_slot_size(store, 0, 3 << 20)
    spare_slots.publish_slot_size(store, 1, 5 << 20)
    store.set("slots/9", b'"junk"')                  # a record that is no size is ignored
    spare_slots._state["next"] = 0.0
    spare_slots.tick(store, shm_root, "spjob", "spare0", 1)
    prep = sorted(f for f in os.listdir(d) if ".prep." in f)
    assert prep == ["deadpool.spjob.prep.r1.0", "deadpool.spjob.prep.r1.1"]
    for f in prep:
        st = os.stat(os.path.join(d, f))
        assert st.st_size == 5 << 20 and st.st_blocks * 512 >= 5 << 20   # allocated, not sparse
    slots = spare_slots.take(d, "spjob", 2, 3 << 20)       # the spare became rank 2, whose slots are smaller
    assert slots is not None and [s.nbytes for s in slots] == [3 << 20, 3 << 20]
    assert sorted(os.listdir(d)) == ["deadpool.spjob.snap.r2.0", "deadpool.spjob.snap.r2.1"]
    slots[0].tensor()[:4].fill_(7)                          # usable as any slot
    assert spare_slots.take(d, "spjob", 2, 3 << 20) is None  # taken once
    for s in slots:
        s.close()


def test_prepared_slots_in_another_directory_are_removed_not_used(store, shm_root):
    spare_slots.publish_slot_size(store, 0, 1 << 20)
    spare_slots.tick(store, shm_root, "spjob", "spare0", 0)
    d = job_shm_dir(shm_root, "spjob", "spare0")
    assert len(os.listdir(d)) == 2
    assert spare_slots.take(os.path.join(shm_root, "elsewhere"), "spjob", 0, 1 << 20) is None
    assert os.listdir(d) == []


def test_a_waiting_spare_also_makes_the_replica_buffers_a_rank_holds_and_its_replicator_adopts_them(store, shm_root):
    """Issue 44: a spare made the buffers it holds for its sources' replicas at its first replication after the
    restore, in the snapshot worker, while the redone step ran; now it makes them while it waits as well."""
    from deadpool_ext.memory.shm import ShmSegment

    spare_slots.publish_slot_size(store, 0, 2 << 20, held=2)  # replication factor 1, double buffer
    spare_slots.publish_slot_size(store, 1, 2 << 20, held=2)
    store.set("held/7", b"-1")                                # a count out of range is ignored
    spare_slots.tick(store, shm_root, "spjob", "spare0", 0)
    d = job_shm_dir(shm_root, "spjob", "spare0")
    assert len([f for f in os.listdir(d) if ".prep." in f]) == 4
    slots = spare_slots.take(d, "spjob", 1, 2 << 20)
    assert slots is not None and len(slots) == 2
    assert spare_slots.adopt(os.path.join(shm_root, "elsewhere"), "x", 1 << 20) is None  # not its directory
    assert spare_slots.adopt(d, "deadpool.spjob.replica.r0.h1b0", 3 << 20) is None  # larger than prepared
    buf = spare_slots.adopt(d, "deadpool.spjob.replica.r0.h1b0", 2 << 20)
    assert isinstance(buf, ShmSegment) and buf.nbytes == 2 << 20
    buf2 = spare_slots.adopt(d, "deadpool.spjob.replica.r0.h1b1", 2 << 20)
    assert buf2 is not None and spare_slots.adopt(d, "deadpool.spjob.replica.r0.h1b2", 2 << 20) is None  # used up
    assert sorted(os.listdir(d)) == ["deadpool.spjob.replica.r0.h1b0", "deadpool.spjob.replica.r0.h1b1",
                                     "deadpool.spjob.snap.r1.0", "deadpool.spjob.snap.r1.1"]
    for s in (*slots, buf, buf2):
        s.close()


def test_a_replicator_makes_what_it_cannot_adopt():
    from deadpool_ext.replicate.peer import PeerReplicator

    calls = []
    r = PeerReplicator.__new__(PeerReplicator)  # only the buffer choice is under test here
    r.kind, r.dir = "dreplica", "/nonexistent"
    r.adopt = lambda name, nbytes: calls.append(name)  # differentials never adopt: their ring is the source's
    with pytest.raises(OSError):
        r._buffer("deadpool.j.dreplica.r0.h1b0", 1 << 20)
    assert calls == []
