"""Probes: one-off measurements that feed no published section of docs/PERFORMANCE.md (tile experiments, launch
floors, Nsight Compute summaries). Their findings go to docs/FINDINGS.md."""
