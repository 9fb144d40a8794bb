"""Many nodes on one machine, and what happens to the service on them: the clusters (a head and
``ray start`` workers, ``local_cluster.py``; worker nodes launched by Ray's own autoscaler,
``autoscaling_cluster.py``) and the scenarios run on them: replicas scaling across nodes
(``cluster_demo.py``), the autoscaler adding and removing a node (``autoscaler_nodes.py``), a
worker node lost (``node_loss.py``), the head lost (``head_loss.py``), a rollout while streams run
(``upgrade_drain.py``). Each has its wrapper in ``scripts/``."""
