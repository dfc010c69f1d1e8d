"""Libraries the tests share (no tests here).

- fleet_harness: redis-server shards, relay processes and the recording workload;
  history: the delivery-guarantee checker those recordings go through; faults: the fault suite's probes.
- k8s_cluster (pytest plugin): real kube-apiserver / kwok control planes; operator_harness (plugin):
  kubectl helpers, the operator as a process and the `kwok_fleet` fixture.
- sentinel_shard: a primary, replicas and Sentinels on loopback; tls_pki: a private CA and TLS Redis;
  tcp_proxy: a link a test can cut.
- spark_session (plugin): one local SparkSession and small shard fleets; soak_option (plugin): `--soak`.
- didcomm_test_agent: a PyNaCl DIDComm agent; didcomm_stock_agents (plugin): Credo-ts and ACA-Py.
"""
