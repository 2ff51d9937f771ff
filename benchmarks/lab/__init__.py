"""The network lab: many hosts on one machine, each with its own full-duplex link
(``network``), and a dtrain deployment across them (``cluster``). docs/lab.md describes both."""

from .network import Host, Lab, LabUnavailable, has_netem, lab_interfaces, probe

__all__ = ["Host", "Lab", "LabUnavailable", "has_netem", "lab_interfaces", "probe"]
