"""Two hosts on this machine (network, UTS and mount namespaces) and an ssh stand-in for hydra."""
