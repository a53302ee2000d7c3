"""Where the system runs: the local stack (``python -m cluster.stack``), the Ray cluster
launcher YAML for AWS (``cluster/aws.yaml``) and the KubeRay manifests (``cluster/kuberay/``).
See cluster/README.md."""
