"""Fake runs: the run on FakeTensors, isolation of user state, snapshots."""
