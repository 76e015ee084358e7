# Finds liburing (ships only a pkg-config file). Defines LibUring::LibUring.
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(PC_LIBURING QUIET liburing)
endif()
find_path(LibUring_INCLUDE_DIR liburing.h HINTS ${PC_LIBURING_INCLUDE_DIRS})
find_library(LibUring_LIBRARY NAMES uring HINTS ${PC_LIBURING_LIBRARY_DIRS})
set(LibUring_VERSION ${PC_LIBURING_VERSION})
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(LibUring
  REQUIRED_VARS LibUring_LIBRARY LibUring_INCLUDE_DIR VERSION_VAR LibUring_VERSION)
if(LibUring_FOUND AND NOT TARGET LibUring::LibUring)
  add_library(LibUring::LibUring UNKNOWN IMPORTED)
  set_target_properties(LibUring::LibUring PROPERTIES
    IMPORTED_LOCATION "${LibUring_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${LibUring_INCLUDE_DIR}")
endif()
mark_as_advanced(LibUring_INCLUDE_DIR LibUring_LIBRARY)
