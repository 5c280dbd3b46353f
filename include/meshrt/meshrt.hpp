// Everything a meshrt program uses.
#pragma once

#include "meshrt/controller.hpp"
#include "meshrt/error.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/log.hpp"
#include "meshrt/ndslice.hpp"
#include "meshrt/reduction.hpp"
#include "meshrt/runtime.hpp"
#include "meshrt/tensor.hpp"
#include "meshrt/value.hpp"
