"""TransferQueue: streams trajectory groups from rollers to the learner (zmq; redis; nixl)."""
