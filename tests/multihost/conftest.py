"""The namespace test bed as pytest fixtures: ``host_bed(n)`` makes n hosts (``deadpool_ext.testing.hosts``) and an
etcd cluster of 3 members on their bridge, and tears everything down after the test, failed or not;
``slurm_bed(n)``: a real Slurm on such a bed (``deadpool_ext.testing.slurm``), n compute nodes and a controller."""
from __future__ import annotations

import secrets

import pytest

from deadpool_ext.testing.hosts import HostBed, missing_requirements
from deadpool_ext.testing.slurm import SlurmBed, missing_slurm


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


@pytest.fixture
def slurm_bed(host_bed, tmp_path):
    """``slurm_bed(n, **settings)``: munged and slurmctld on a control host, one slurmd per compute host (n of
    them; ``settings``: SlurmBed's fields), on a host bed of n + 1 hosts with its etcd cluster; stopped after the
    test, failed or not (the bed after it)."""
    beds: list[SlurmBed] = []

    def make(nodes: int, **settings) -> SlurmBed:
        why = missing_slurm()
        if why is not None:
            pytest.skip(f"Slurm bed: {why} (CI installs slurm-wlm and munge)")
        slurm = SlurmBed(host_bed(nodes + 1), nodes=nodes, workdir=str(tmp_path), **settings)
        beds.append(slurm)
        slurm.start()
        return slurm

    try:
        yield make
    finally:
        for slurm in beds:
            slurm.stop()
