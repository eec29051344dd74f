"""SkyRL 0.3 with r3bridge: the entry point ships with r3bridge (``r3bridge.adapters.skyrl.main``),
so it runs from any folder. Copy that module to customise the generator / trainer subclasses.

    python -m r3bridge.adapters.skyrl.main trainer.r3bridge.replay_mode=R3 <SkyRL's overrides>
"""
from r3bridge.adapters.skyrl.main import main

if __name__ == "__main__":
    main()
