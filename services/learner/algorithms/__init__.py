"""RL algorithms behind one seam (base.py), chosen by ``algorithm.name`` (factory.py); one module each."""
