# placeholder, replaced by the native helper
def hash64(obj):
    raise NotImplementedError
