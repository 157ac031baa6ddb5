"""The namespace test bed as pytest fixtures: ``host_bed(n)`` makes n hosts (``deadpool_ext.testing.hosts``) and an
etcd cluster of 3 members on their bridge, and tears everything down after the test, failed or not."""
from __future__ import annotations

import secrets

import pytest

from deadpool_ext.testing.hosts import HostBed, missing_requirements


@pytest.fixture
def host_bed(tmp_path):
    beds: list[HostBed] = []

    def make(n_hosts: int, *, etcd_members: int = 3) -> HostBed:
        why = missing_requirements()
        if why is not None:
            pytest.skip(f"multi-host bed: {why} (CI runs as root)")
        bed = HostBed(n_hosts, workdir=str(tmp_path), shm_size="3g")
        beds.append(bed)
        bed.start()
        if etcd_members:
            bed.start_etcd(secrets.token_urlsafe(24), members=etcd_members)
        return bed

    try:
        yield make
    finally:
        for bed in beds:
            bed.close()
