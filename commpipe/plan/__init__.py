"""Cost model and planner: memory, time and ranking of TP x CP x PP x DP layouts (no torch).

    from commpipe.plan import Job, Layout, default_cluster, estimate, resolve_gpu, search
"""

from commpipe.plan.cluster import Cluster, Link, default_cluster
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.estimate import Estimate, estimate
from commpipe.plan.gpus import GPU, GPUS, resolve_gpu
from commpipe.plan.layout import Job, Layout, enumerate_layouts, layout_problem
from commpipe.plan.search import SearchResult, search

__all__ = ["Cluster", "Link", "default_cluster", "Estimate", "estimate", "GPU", "GPUS",
           "resolve_gpu", "Job", "Layout", "enumerate_layouts", "layout_problem", "SearchResult",
           "search", "Efficiency"]
