"""Libraries the tests share (no tests here): fleet processes and the recording workload
(fleet_harness), fault-suite helpers (faults)."""
