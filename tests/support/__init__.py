"""Libraries the tests share (no tests here; tests/project/test_layers.py keeps test modules from
importing one another or a conftest, so shared helpers land here).

- Relays and fleets: in_process_relay (the `relay_factory` relays), fleet_harness (redis-server
  shards, relay processes, the recording workload), history (the delivery-guarantee checker),
  faults (the fault suite's probes), migration_crash (crashing `relayfleet migrate` at a step),
  procs (stopping a subprocess).
- Kubernetes: k8s_cluster (plugin: real kube-apiserver / kwok control planes), operator_harness
  (plugin: kubectl helpers, the operator as a process, `kwok_fleet`, `apiserver_ns`), chart (the
  CRDs, the pinned helm, the rendered chart), shard_specs (RelayShard documents).
- Redis: sentinel_shard (a primary, replicas and Sentinels on loopback), tls_pki (a private CA and
  TLS Redis), tcp_proxy (a link a test can cut).
- Observability: observability (the chart's rules and dashboards as data), prometheus (a real
  Prometheus).
- Spark: spark_session (plugin: one local SparkSession, small shard fleets), naive_planner.
- DIDComm: didcomm_test_agent (a PyNaCl agent), didcomm_stock_agents (plugin: Credo-ts, ACA-Py,
  the Identus and Veramo v2 clients), client_history (a stock v2 client's run as a history).
- soak_option (plugin: `--soak`).
"""
