"""PySpark jobs over the whole fleet: rebalance planning and retention (docs/spark.md).

Each job cuts the shard map into (shard, slot range) tasks that Spark runs in
parallel, locally (`local[*]`) or on Kubernetes (spark-submit, executors as
pods). See docs/spark.md.
"""
