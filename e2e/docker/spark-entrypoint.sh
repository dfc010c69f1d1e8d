#!/usr/bin/env bash
# Entrypoint of the relayfleet-spark image.
#   executor   an executor pod created by spark-submit in Kubernetes mode: start the executor
#              backend with what Spark put in the pod's environment (SPARK_* variables)
#   anything   run it (the CronJobs run /opt/spark/bin/spark-submit with their own args)
set -euo pipefail

if [ "${1:-}" != "executor" ]; then
  exec "$@"
fi

: "${SPARK_EXECUTOR_MEMORY:=1g}"
classpath="${SPARK_HOME}/jars/*"
if [ -n "${SPARK_EXTRA_CLASSPATH:-}" ]; then
  classpath="${classpath}:${SPARK_EXTRA_CLASSPATH}"
fi
# Spark passes the executor's JVM options as SPARK_JAVA_OPT_0, SPARK_JAVA_OPT_1, ...
java_opts=()
while IFS='=' read -r name value; do
  case "$name" in
    SPARK_JAVA_OPT_*) java_opts+=("$value") ;;
  esac
done < <(env | sort -t_ -k4 -n)

exec "${JAVA_HOME}/bin/java" \
  "${java_opts[@]}" \
  -Xms"${SPARK_EXECUTOR_MEMORY}" -Xmx"${SPARK_EXECUTOR_MEMORY}" \
  -cp "$classpath" \
  org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
  --driver-url "${SPARK_DRIVER_URL}" \
  --executor-id "${SPARK_EXECUTOR_ID}" \
  --cores "${SPARK_EXECUTOR_CORES}" \
  --app-id "${SPARK_APPLICATION_ID}" \
  --hostname "${SPARK_EXECUTOR_POD_IP}" \
  --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID:-0}" \
  --podName "${SPARK_EXECUTOR_POD_NAME}"
