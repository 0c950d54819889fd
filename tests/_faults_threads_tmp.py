import threading, atexit, sys, traceback
def dump():
    for t in threading.enumerate():
        print("THREAD", t.name, t.daemon, file=sys.stderr)
        fr = sys._current_frames().get(t.ident)
        if fr and t is not threading.main_thread(): traceback.print_stack(fr, limit=6, file=sys.stderr)
def pytest_unconfigure(config):
    dump()
