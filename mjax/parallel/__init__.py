"""Everything that knows about devices: meshes and logical-axis rules."""

from mjax.parallel.mesh import make_mesh
from mjax.parallel.rules import logical_rules

__all__ = ['make_mesh', 'logical_rules']
