// Umbrella header of the steptrace C++ API.
#pragma once

#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"
#include "steptrace/error.hpp"
#include "steptrace/profiler.hpp"
#include "steptrace/replay.hpp"
