"""TEST-ONLY pod runner: a stand-in kubelet for one fake node of a kwok cluster.

kwok's nodes run no containers. For the end-to-end tests this process registers a node of
its own (not managed by kwok: it keeps the node's Lease and Ready condition itself), and for
every Pod of one namespace bound to that node starts the matching local process:

* ``redis-server ...``        -> /usr/bin/redis-server with the Pod's mounted config
* ``relayfleet ...``          -> the venv's ``relayfleet`` with the Pod's env and args
* ``.../spark-submit ... local:///app/spark_jobs/X.py ARGS`` -> ``python -m spark_jobs.X ARGS
  --master local[2]`` (the driver runs here; no executor pods)

Volumes become directories (Secrets and ConfigMaps written as files and refreshed, emptyDir
and PVCs as temp dirs, the service-account token from the TokenRequest API plus a kubeconfig
using it); paths, ports and 0.0.0.0 in args and env are rewritten to those directories, to a
free loopback port per containerPort, and to 127.0.0.1. Readiness probes run against the
process and are reported through the Pod's status; exits follow restartPolicy. Service names
resolve through a JSON address table (see e2e/podenv/sitecustomize.py) rebuilt from the
Services' selectors and the pods' readiness. Everything above the kubelet is the real control
plane. Never use this outside tests.

    python -m e2e.podrunner --kubeconfig K --namespace NS --node NODE --workdir DIR

Its parts, one job each:

* ``kube``        raw JSON calls to the API server (and its timestamp format)
* ``pods``        what the runner knows of a pod and of its one process
* ``node``        the Node object, its heartbeat and Lease, PersistentVolumes for pending claims
* ``volumes``     Secrets, ConfigMaps, projected tokens and claims as directories
* ``translate``   a container spec -> argv and environment of a local stand-in process
* ``supervisor``  starting (output captured in the pod's log file), restarting, probing, stopping
* ``status``      the Pod status a kubelet would report
* ``services``    Service names -> loopback ports (the address table e2e/podenv reads)
* ``runner``      the loop that ties them together; ``__main__`` its command line
"""
