# Debian 12 ships xsimd 8.1.0 whose exported target `xsimd` lists `xtl` in INTERFACE_LINK_LIBRARIES
# although xtl is neither installed nor needed (xsimd's xtl support is optional and off by default).
# Linking would then fail with `-lxtl: not found`. Drop the dangling name unless a real xtl target exists.
if(TARGET xsimd AND NOT TARGET xtl)
  get_target_property(_kvc_xsimd_links xsimd INTERFACE_LINK_LIBRARIES)
  if(_kvc_xsimd_links)
    list(REMOVE_ITEM _kvc_xsimd_links xtl)
    set_target_properties(xsimd PROPERTIES INTERFACE_LINK_LIBRARIES "${_kvc_xsimd_links}")
  endif()
  unset(_kvc_xsimd_links)
endif()
