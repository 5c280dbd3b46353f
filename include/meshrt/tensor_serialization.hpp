// Boost.Serialization for DType, Device, TensorMeta and Tensor, kept out of tensor.hpp so
// that only code that serializes pays for Boost's headers. A Tensor travels as its meta
// and its bytes (one binary block, no per-element work); a CUDA tensor is copied to the
// host to save and arrives on the CPU when loaded (MPI never sees device memory).
#pragma once

#include <boost/serialization/binary_object.hpp>
#include <boost/serialization/split_free.hpp>
#include <boost/serialization/string.hpp>
#include <boost/serialization/vector.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "meshrt/tensor.hpp"

namespace boost::serialization {

template <class Archive>
void save(Archive& ar, const meshrt::Device& d, unsigned /*version*/) {
  const std::string text = d.to_string();
  ar << text;
}
template <class Archive>
void load(Archive& ar, meshrt::Device& d, unsigned /*version*/) {
  std::string text;
  ar >> text;
  d = meshrt::Device::parse(text);
}

template <class Archive>
void save(Archive& ar, const meshrt::TensorMeta& m, unsigned /*version*/) {
  const auto dtype = static_cast<std::uint8_t>(m.dtype());
  ar << m.shape() << dtype << m.device();
}
template <class Archive>
void load(Archive& ar, meshrt::TensorMeta& m, unsigned /*version*/) {
  std::vector<std::int64_t> shape;
  std::uint8_t dtype = 0;
  meshrt::Device device;
  ar >> shape >> dtype >> device;
  // The constructor validates the dtype and shape, so a corrupt archive raises UsageError.
  m = meshrt::TensorMeta(std::move(shape), static_cast<meshrt::DType>(dtype), device);
}

template <class Archive>
void save(Archive& ar, const meshrt::Tensor& t, unsigned /*version*/) {
  const bool defined = t.defined();
  ar << defined;
  if (!defined) return;
  const meshrt::Tensor host = t.to(meshrt::Device::cpu());
  const meshrt::TensorMeta meta = host.meta();
  ar << meta;
  ar << boost::serialization::make_binary_object(const_cast<void*>(host.raw_data()), host.nbytes());
}
template <class Archive>
void load(Archive& ar, meshrt::Tensor& t, unsigned /*version*/) {
  bool defined = false;
  ar >> defined;
  if (!defined) {
    t = meshrt::Tensor();
    return;
  }
  meshrt::TensorMeta meta;
  ar >> meta;
  t = meshrt::Tensor::empty(meta.with_device(meshrt::Device::cpu()));
  ar >> boost::serialization::make_binary_object(t.raw_data(), t.nbytes());
}

}  // namespace boost::serialization

BOOST_SERIALIZATION_SPLIT_FREE(meshrt::Device)
BOOST_SERIALIZATION_SPLIT_FREE(meshrt::TensorMeta)
BOOST_SERIALIZATION_SPLIT_FREE(meshrt::Tensor)
